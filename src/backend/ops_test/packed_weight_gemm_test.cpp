// Op tests of Backend::matmul_nt_nvfp4_weight (the rollout engine's decode GEMM on packed two-level
// NVFP4 weights) on every backend that has Op::kNvfp4WeightGemm: y = x . dequantize(w)^T against a
// double reference on the backend's own dequantize() within the bound derived below, for batch
// sizes across both CUDA kernels (the GEMV's row tiles for M <= 8, the BF16 tensor-core kernel's
// 16/32/64-row tiles and K splits beyond), N not a multiple of either kernel's tile, K with a
// partial 128-block, activations that are BF16 numbers (w4a16) and that are not (w4a4's
// dequantized activations: the kernel's three-part split); the OLMo-2 1B decode linears at
// M = 9 .. 256; the same bits on a second call (no atomics); the grouped (MoE experts) form.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"

namespace nibble::backend::testing {
namespace {

// Bound, relative to mag = sum_k |w_k x_k| (w = dequantize(q), u = 2^-24), the larger of two paths':
//  - the CPU (dequantize + matmul_nt) and the CUDA GEMV (M <= 8) multiply the very FP32 values
//    w_k x_k and sum K terms in some order (with or without FMA): gamma_K <= (K + 2) u.
//  - the CUDA tensor-core kernel (M > 8, backend/cuda/fp4_weight_mma.cuh) computes
//    sum_c fma(so_c, P_c, .) with P_c = sum_{k in chunk c} (e2m1 * e4m3)_k x_k on BF16 MMAs:
//    (1) w_k = e2m1 * fl(e4m3 * so) is the exact e2m1 * e4m3 * so times (1 + d), |d| <= 2u + u^2
//        (two roundings): 2u (to first order);
//    (2) P_c: the products are exact (BF16 x BF16, x = hi + mid + lo exactly); an m16n8k16 MMA
//        with FP32 accumulation is taken to align its 16 products and the accumulator to the
//        largest exponent and truncate (Fasi et al. 2021, "Numerical behavior of NVIDIA tensor
//        cores"): < 1 unit of 2^-23 of the running magnitude per addend, one more for the result,
//        <= 18 * 2^-23 = 36u of mag_c per MMA; 8 MMAs along a 128-chunk per part of x (1 part
//        for a BF16 x, 3 otherwise): 288 * parts * u;
//    (3) one fma per chunk and (4) at most one addition per chunk in the K-split sum: 2 u per chunk.
//    Total (2 + 288 parts + 2 ceil(K/128)) u.
// Checked with a factor 2 margin as the other op tests. A bug that loses or mis-scales one 16-block
// moves y by about 16/K of mag, far above the bound at these K.
double packed_gemm_bound(int64_t K, bool x_is_bf16, double mag) {
  const double parts = x_is_bf16 ? 1.0 : 3.0;
  const double plain = static_cast<double>(K + 2);
  const double tensor_core = 2.0 + 288.0 * parts + 2.0 * static_cast<double>((K + 127) / 128);
  return 2.0 * std::max(plain, tensor_core) * 0x1.0p-24 * mag;
}

struct PackedWeight {
  QuantizedBuffer qb;
  QuantizedTensor q;
  std::vector<float> wd;  // (N, K) dequantize(q)
};

class PackedWeightGemmOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kNvfp4WeightGemm))
      GTEST_SKIP() << "backend '" << be().name() << "' has no packed NVFP4 weight GEMM";
  }
  // Weights with rows of different magnitudes (2^-6 .. 2^5), quantized by the backend's quantizer.
  // Large weights repeat a pool of normal values with a prime period (the draws would dominate
  // the test's time); rows still differ (the period is not a multiple of K).
  void make_weight(PackedWeight& pw, int64_t N, int64_t K) {
    constexpr int64_t kPool = 1048573;  // prime
    const std::vector<float> pool = normal_vector(std::min(N * K, kPool), 41 + N, 1.0);
    std::vector<float> w(static_cast<size_t>(N * K));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        w[n * K + k] = std::ldexp(pool[static_cast<size_t>((n * K + k) % kPool)], static_cast<int>(n % 12) - 6);
    pw.q = pw.qb.view(be(), QuantFormat::kNvfp4TwoLevel, N, K);
    be().quantize(pw.q, upload(w));
    float* wd_dev = zeros<float>(N * K);
    be().dequantize(wd_dev, pw.q);
    pw.wd = download(wd_dev, N * K);
  }
  // Runs the op for (M, N, K), checks the columns `cols` (all rows) against the double reference,
  // then (twice) a second call for the same bits. x_is_bf16: x holds BF16 numbers (else any FP32).
  void check(const PackedWeight& pw, int64_t M, int64_t N, int64_t K, const std::vector<int64_t>& cols,
             bool x_is_bf16, bool twice = true) {
    SCOPED_TRACE(fmt::format("M={} N={} K={} x {}", M, N, K, x_is_bf16 ? "bf16" : "f32"));
    std::vector<float> x = normal_vector(M * K, 43 + M, 1.0);
    if (x_is_bf16)
      for (float& v : x) v = round_to_bf16(v);  // the engine's BF16 activation (w4a16)
    float* x_dev = upload(x);
    float* y_dev = zeros<float>(M * N);
    be().matmul_nt_nvfp4_weight(y_dev, x_dev, pw.q, M);
    const std::vector<float> y = download(y_dev, M * N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n : cols) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          ref += double(pw.wd[n * K + k]) * x[m * K + k];
          mag += std::fabs(double(pw.wd[n * K + k]) * x[m * K + k]);
        }
        ASSERT_LE(std::fabs(y[m * N + n] - ref), packed_gemm_bound(K, x_is_bf16, mag))
            << "y[" << m << "," << n << "] = " << y[m * N + n] << ", reference " << ref;
      }
    if (!twice) return;
    float* y2_dev = zeros<float>(M * N);
    be().matmul_nt_nvfp4_weight(y2_dev, x_dev, pw.q, M);
    ASSERT_TRUE(bits_equal(y, download(y2_dev, M * N)));
  }
};

std::vector<int64_t> all_columns(int64_t N) {
  std::vector<int64_t> c(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) c[static_cast<size_t>(n)] = n;
  return c;
}

TEST_P(PackedWeightGemmOpsTest, EqualsDequantizeThenGemmWithinTheSummationBound) {
  struct Shape {
    int64_t M, N, K;
    bool x_bf16;
  };
  // GEMV row tiles (1 .. 8), the MMA kernel's 16/32/64-row tiles with N % 64 != 0, K % 128 != 0,
  // an M past 64 (two row blocks), and non-BF16 activations on both kernels
  for (Shape s : {Shape{1, 37, 96, true}, Shape{3, 64, 160, true}, Shape{8, 130, 256, true}, Shape{13, 48, 512, true},
                  Shape{64, 33, 128, true}, Shape{9, 37, 96, true}, Shape{17, 130, 160, true},
                  Shape{33, 65, 224, true}, Shape{70, 64, 352, true}, Shape{5, 40, 160, false},
                  Shape{9, 37, 96, false}, Shape{40, 70, 288, false}}) {
    PackedWeight pw;
    make_weight(pw, s.N, s.K);
    check(pw, s.M, s.N, s.K, all_columns(s.N), s.x_bf16);
    if (HasFatalFailure()) return;
  }
}

// The OLMo-2 1B decode linears (hidden 2048, MLP 8192) at the batches the MMA kernel serves. The
// double reference runs on every 61st column (61 is prime: the columns meet every residue of the
// kernel's 64-row weight tile and of its warps' 16-row tiles) and the last one, all rows; the
// second call for the same bits at M = 64 (the K-split sum) and for the FP32 activation.
TEST_P(PackedWeightGemmOpsTest, Olmo1bDecodeLinears) {
  struct NK {
    int64_t N, K;
  };
  for (NK nk : {NK{2048, 2048}, NK{8192, 2048}, NK{2048, 8192}}) {
    PackedWeight pw;
    make_weight(pw, nk.N, nk.K);
    std::vector<int64_t> cols;
    for (int64_t n = 0; n < nk.N; n += 61) cols.push_back(n);
    cols.push_back(nk.N - 1);
    for (int64_t M : {9, 16, 33, 64, 256}) {
      check(pw, M, nk.N, nk.K, cols, /*x_is_bf16=*/true, /*twice=*/M == 64);
      if (HasFatalFailure()) return;
    }
    check(pw, 33, nk.N, nk.K, cols, /*x_is_bf16=*/false);  // w4a4's dequantized activation
    if (HasFatalFailure()) return;
  }
}

// Batch 1 on both CUDA GEMV kernels: N below 4096 (the per-column kernel) and from 4096 (the row
// kernel, four columns a warp, a partial last warp at N = 4102), every column, BF16 and FP32 x.
TEST_P(PackedWeightGemmOpsTest, BatchOneOnBothGemvKernels) {
  for (const int64_t N : {int64_t{2048}, int64_t{4102}}) {
    PackedWeight pw;
    make_weight(pw, N, 2048);
    for (const bool bf16 : {true, false}) {
      check(pw, 1, N, 2048, all_columns(N), bf16);
      if (HasFatalFailure()) return;
    }
  }
}

// grouped_matmul_nt_nvfp4_weight (the fused MoE decode): G experts' weights back to back (one
// (G N, K) two-level tensor: the format is row-local, so its rows [g N, (g+1) N) are expert g's
// (N, K) tensor), rows grouped by device offsets with empty experts, experts of 1 .. 8 rows (one
// GEMV tile) and of 9 and 17 (two and three tiles), rows past offsets[G] left alone. Every row
// within the summation bound of the double reference, and each expert of at most 8 rows equal to
// matmul_nt_nvfp4_weight on its rows alone, bit for bit (the same per-row arithmetic: the GEMV on
// CUDA, dequantize + matmul_nt on the CPU); a second call gives the same bits.
TEST_P(PackedWeightGemmOpsTest, GroupedExpertsEqualEachExpertAlone) {
  for (const bool x_bf16 : {true, false}) {
    constexpr int64_t G = 7, N = 37, K = 160;
    SCOPED_TRACE(x_bf16 ? "bf16 x" : "f32 x");
    const std::vector<int64_t> counts = {3, 0, 8, 1, 17, 0, 9};
    std::vector<int64_t> off(G + 1, 0);
    for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + counts[g];
    const int64_t used = off[G], rows = used + 2;  // two rows past the last group
    PackedWeight pw;
    make_weight(pw, G * N, K);
    std::vector<float> x = normal_vector(rows * K, 91, 1.0);
    if (x_bf16)
      for (float& v : x) v = round_to_bf16(v);
    float* x_dev = upload(x);
    const int64_t* off_dev = upload(off);
    std::vector<float> y0(static_cast<size_t>(rows * N), -7.0f);  // the sentinel rows past off[G] keep
    float* y_dev = upload(y0);
    QuantizedTensor w0 = pw.q;
    w0.rows = N;
    be().grouped_matmul_nt_nvfp4_weight(y_dev, x_dev, w0, off_dev, G, rows);
    const std::vector<float> y = download(y_dev, rows * N);
    for (int64_t g = 0; g < G; ++g) {
      SCOPED_TRACE(fmt::format("expert {} rows [{}, {})", g, off[g], off[g + 1]));
      for (int64_t m = off[g]; m < off[g + 1]; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double p = double(pw.wd[(g * N + n) * K + k]) * x[m * K + k];
            ref += p, mag += std::fabs(p);
          }
          ASSERT_LE(std::fabs(y[m * N + n] - ref), packed_gemm_bound(K, x_bf16, mag)) << "y[" << m << "," << n << "]";
        }
      if (counts[g] == 0 || counts[g] > 8) continue;
      QuantizedTensor wg = w0;
      wg.codes += g * QuantizedTensor::code_bytes(wg.format, N, K);
      wg.scales += g * QuantizedTensor::scale_bytes(wg.format, N, K);
      wg.outer += g * QuantizedTensor::outer_count(wg.format, N, K);
      float* yg_dev = zeros<float>(counts[g] * N);
      be().matmul_nt_nvfp4_weight(yg_dev, x_dev + off[g] * K, wg, counts[g]);
      const std::vector<float> yg = download(yg_dev, counts[g] * N);
      ASSERT_TRUE(bits_equal(yg, std::vector<float>(y.begin() + off[g] * N, y.begin() + off[g + 1] * N)));
    }
    for (int64_t i = used * N; i < rows * N; ++i) ASSERT_EQ(y[i], -7.0f) << "row " << i / N << " past the groups";
    float* y2_dev = upload(y0);
    be().grouped_matmul_nt_nvfp4_weight(y2_dev, x_dev, w0, off_dev, G, rows);
    ASSERT_TRUE(bits_equal(y, download(y2_dev, rows * N)));
  }
}

NIB_INSTANTIATE_OPS_TEST(PackedWeightGemmOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
