// Op tests of the GEMMs (matmul_nt / nn / tn, overwrite and accumulate, FP32 and BF16 operands)
// against cpu::matmul_* with odd shapes, and the batch-invariant NT mode (at the end). Bound:
// round-to-nearest sums of K products are within (K+1) u sum|terms| of the exact sum (Higham,
// Thm 3.5; the accumulated y0 is one more term); tensor cores may truncate in FP32 accumulation
// (Fasi et al. 2021: <= 2u per addition), so the GPU is within 2 (K+1) u sum|terms|: |y - ref| <=
// (3K + 6) u (sum_k |a b| + |y0|). A wrong layout exceeds it by orders of magnitude; TF32 products
// (operands rounded to 2^-11) by 24x, 10x and 2x at K = 53, 96, 257 (simulated, largest element):
// the FP32 path must be true FP32. The BF16-operand GEMMs (matmul_bf16_*: BF16 bits in, alpha in
// backend memory) are checked the same way against the FP32 product of the widened operands, alpha
// applied once more: one more rounding of |alpha s| <= |alpha| sum|terms|, so (3K + 8) u (|alpha|
// sum_k |a b| + |y0|).
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/ops_test/ops_test_util.h"
#include "backend/ops_test/tolerance_util.h"
#include "core/bits.h"

namespace nibble::backend::testing {
namespace {

enum class Layout { kNT, kNN, kTN };

struct GemmCase {
  int64_t M, N, K;
};

class GemmOpsTest : public OpsTest {
 protected:
  // One product on the backend under test against the CPU reference. bf16: operands rounded to
  // BF16 first (the caller's promise) and multiplied with operands_bf16 = true.
  void check(Layout layout, GemmCase c, bool accumulate, bool bf16, uint64_t seed) {
    const int64_t M = c.M, N = c.N, K = c.K;
    std::vector<float> a = normal_vector(M * K, seed), b = normal_vector(N * K, seed + 1);
    std::vector<float> y0 = normal_vector(M * N, seed + 2);
    if (bf16) {
      for (float& v : a) v = round_to_bf16(v);
      for (float& v : b) v = round_to_bf16(v);
    }
    std::vector<float> ref = accumulate ? y0 : std::vector<float>(static_cast<size_t>(M * N), 0.0f);
    std::vector<double> abs_a(a.size()), abs_b(b.size());
    for (size_t i = 0; i < a.size(); ++i) abs_a[i] = std::fabs(double(a[i]));
    for (size_t i = 0; i < b.size(); ++i) abs_b[i] = std::fabs(double(b[i]));
    std::vector<double> mag(static_cast<size_t>(M * N), 0.0);  // sum_k |a_ik b_kj|
    float* y = upload(accumulate ? y0 : std::vector<float>(static_cast<size_t>(M * N), 7.0f));
    const float* ad = upload(a);
    const float* bd = upload(b);
    switch (layout) {
      case Layout::kNT:
        cpu::matmul_nt(ref.data(), a.data(), b.data(), M, N, K, accumulate);
        cpu::matmul_nt(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_nt(y, ad, bd, M, N, K, accumulate, bf16);
        break;
      case Layout::kNN:
        cpu::matmul_nn(ref.data(), a.data(), b.data(), M, N, K, accumulate);
        cpu::matmul_nn(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_nn(y, ad, bd, M, N, K, accumulate, bf16);
        break;
      case Layout::kTN:
        cpu::matmul_tn(ref.data(), a.data(), b.data(), M, N, K, accumulate);
        cpu::matmul_tn(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_tn(y, ad, bd, M, N, K, accumulate, bf16);
        break;
    }
    std::vector<double> bound(mag.size());
    for (size_t i = 0; i < mag.size(); ++i)
      bound[i] = double(3 * K + 6) * kUnitRoundoff * (mag[i] + (accumulate ? std::fabs(double(y0[i])) : 0.0));
    EXPECT_TRUE(within_bound(download(y, M * N), ref, bound))
        << "layout " << int(layout) << " M=" << M << " N=" << N << " K=" << K << " accumulate=" << accumulate
        << " bf16=" << bf16;
  }

  // matmul_bf16_* with a, b as BF16 bits and alpha (1) in backend memory, or null (1).
  void check_bf16_bits(Layout layout, GemmCase c, bool accumulate, const float* alpha_host, uint64_t seed) {
    const int64_t M = c.M, N = c.N, K = c.K;
    std::vector<float> a = normal_vector(M * K, seed), b = normal_vector(N * K, seed + 1);
    std::vector<float> y0 = normal_vector(M * N, seed + 2);
    std::vector<uint16_t> ab(a.size()), bb(b.size());
    for (size_t i = 0; i < a.size(); ++i) ab[i] = f32_to_bf16_bits(a[i]), a[i] = bf16_bits_to_f32(ab[i]);
    for (size_t i = 0; i < b.size(); ++i) bb[i] = f32_to_bf16_bits(b[i]), b[i] = bf16_bits_to_f32(bb[i]);
    std::vector<float> sum(static_cast<size_t>(M * N), 0.0f);
    std::vector<double> abs_a(a.begin(), a.end()), abs_b(b.begin(), b.end());
    for (double& v : abs_a) v = std::fabs(v);
    for (double& v : abs_b) v = std::fabs(v);
    std::vector<double> mag(static_cast<size_t>(M * N), 0.0);  // sum_k |a_ik b_kj|
    // overwrite must not read y: NaN there (beta = 0 read from device memory would give 0 · NaN)
    float* y = upload(accumulate ? y0 : std::vector<float>(static_cast<size_t>(M * N), std::nanf("")));
    const uint16_t* ad = upload(ab);
    const uint16_t* bd = upload(bb);
    const float* alpha = alpha_host ? upload(std::vector<float>{*alpha_host}) : nullptr;
    switch (layout) {
      case Layout::kNT:
        cpu::matmul_nt(sum.data(), a.data(), b.data(), M, N, K);
        cpu::matmul_nt(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_bf16_nt(y, ad, bd, M, N, K, alpha, accumulate);
        break;
      case Layout::kNN:
        cpu::matmul_nn(sum.data(), a.data(), b.data(), M, N, K);
        cpu::matmul_nn(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_bf16_nn(y, ad, bd, M, N, K, alpha, accumulate);
        break;
      case Layout::kTN:
        cpu::matmul_tn(sum.data(), a.data(), b.data(), M, N, K);
        cpu::matmul_tn(mag.data(), abs_a.data(), abs_b.data(), M, N, K, false);
        be().matmul_bf16_tn(y, ad, bd, M, N, K, alpha, accumulate);
        break;
    }
    const double s = alpha_host ? *alpha_host : 1.0;
    std::vector<float> ref(sum.size());
    std::vector<double> bound(mag.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i] = static_cast<float>(s * sum[i] + (accumulate ? double(y0[i]) : 0.0));
      bound[i] = double(3 * K + 8) * kUnitRoundoff * (std::fabs(s) * mag[i] + (accumulate ? std::fabs(double(y0[i])) : 0.0));
    }
    EXPECT_TRUE(within_bound(download(y, M * N), ref, bound))
        << "layout " << int(layout) << " M=" << M << " N=" << N << " K=" << K << " accumulate=" << accumulate
        << " alpha=" << (alpha_host ? *alpha_host : 1.0f);
  }
};

const GemmCase kCases[] = {{1, 1, 1}, {37, 29, 53}, {64, 48, 96}, {130, 70, 257}, {3, 200, 17}};

// Every layout, overwrite and accumulate, alpha absent, a power of two, and a general value
// (a scale of 1e-5: an alpha left out or applied twice is off by orders of magnitude).
TEST_P(GemmOpsTest, Bf16BitsOperandsWithDeviceAlpha) {
  uint64_t seed = 1700;
  const float alphas[] = {0.25f, 3.7e-5f};
  for (Layout l : {Layout::kNT, Layout::kNN, Layout::kTN})
    for (const GemmCase& c : kCases)
      for (bool acc : {false, true}) {
        check_bf16_bits(l, c, acc, nullptr, seed += 3);
        for (const float& al : alphas) check_bf16_bits(l, c, acc, &al, seed += 3);
      }
}

TEST_P(GemmOpsTest, Fp32AllLayoutsOverwriteAndAccumulate) {
  uint64_t seed = 100;
  for (Layout l : {Layout::kNT, Layout::kNN, Layout::kTN})
    for (const GemmCase& c : kCases)
      for (bool acc : {false, true}) check(l, c, acc, /*bf16=*/false, seed += 3);
}

TEST_P(GemmOpsTest, Bf16OperandsAllLayoutsOverwriteAndAccumulate) {
  uint64_t seed = 900;
  for (Layout l : {Layout::kNT, Layout::kNN, Layout::kTN})
    for (const GemmCase& c : kCases)
      for (bool acc : {false, true}) check(l, c, acc, /*bf16=*/true, seed += 3);
}

// The same shape twice (the CUDA backend's cached plan) and at an offset pointer (another
// alignment: a second plan) gives the reference both times, and the same bits the second time
// (cuBLASLt is run-to-run reproducible on one GPU: the step's determinism relies on it).
TEST_P(GemmOpsTest, RepeatedShapeAndUnalignedOutput) {
  const int64_t M = 9, N = 11, K = 33;
  std::vector<float> a = normal_vector(M * K, 5), b = normal_vector(N * K, 6);
  std::vector<float> ref(static_cast<size_t>(M * N));
  cpu::matmul_nt(ref.data(), a.data(), b.data(), M, N, K, false);
  std::vector<double> mag(ref.size());
  std::vector<double> aa(a.begin(), a.end()), bb(b.begin(), b.end());
  for (double& v : aa) v = std::fabs(v);
  for (double& v : bb) v = std::fabs(v);
  cpu::matmul_nt(mag.data(), aa.data(), bb.data(), M, N, K, false);
  std::vector<double> bound(mag.size());
  for (size_t i = 0; i < mag.size(); ++i) bound[i] = double(3 * K + 6) * kUnitRoundoff * mag[i];
  const float* ad = upload(a);
  const float* bd = upload(b);
  float* y = zeros<float>(M * N + 1);
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    be().matmul_nt(y, ad, bd, M, N, K);
    std::vector<float> got = download(y, M * N);
    EXPECT_TRUE(within_bound(got, ref, bound)) << "repeat " << rep;
    if (rep == 0) first = got;
    else EXPECT_TRUE(bits_equal(got, first));
    be().matmul_nt(y + 1, ad, bd, M, N, K);
    std::vector<float> shifted = download(y, M * N + 1);
    EXPECT_TRUE(within_bound(std::vector<float>(shifted.begin() + 1, shifted.end()), ref, bound)) << "offset " << rep;
  }
}

// Backend::set_batch_invariant (inference): each row of matmul_nt and of matmul_bf16_nt (with alpha,
// overwrite and accumulate) is the same bits as that row multiplied alone (M = 1), wherever it sits
// among other rows and whatever M is, and the FP32 product stays within the bound above (a fixed
// order of round-to-nearest additions). K = 7, 37, 130 cover the zero-padded last 16-lane chunk,
// N = 5, 19, 70 the edge blocks of 4 weights. Skipped where the backend does not offer the mode.
TEST_P(GemmOpsTest, BatchInvariantNtRowsAreTheRowAlone) {
  if (!be().set_batch_invariant(true)) GTEST_SKIP() << be().name() << " does not offer batch-invariant GEMMs";
  struct Off {
    Backend& b;
    ~Off() { b.set_batch_invariant(false); }
  } off{be()};
  const float alpha_host = 0.37f;
  const float* alpha = upload(std::vector<float>{alpha_host});
  uint64_t seed = 2100;
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{5, 7}, {19, 37}, {70, 130}}) {
    const std::vector<float> row = normal_vector(K, seed += 7), w = normal_vector(N * K, seed += 7);
    const std::vector<float> y0_row = normal_vector(N, seed += 7);
    std::vector<uint16_t> row_b(row.size()), w_b(w.size());
    for (size_t i = 0; i < row.size(); ++i) row_b[i] = f32_to_bf16_bits(row[i]);
    for (size_t i = 0; i < w.size(); ++i) w_b[i] = f32_to_bf16_bits(w[i]);
    const float* wd = upload(w);
    const uint16_t* wbd = upload(w_b);
    // The row alone: FP32 overwrite, BF16 bits with alpha accumulating onto y0_row.
    float* y = upload(std::vector<float>(static_cast<size_t>(N), 7.0f));
    be().matmul_nt(y, upload(row), wd, 1, N, K, false, false);
    const std::vector<float> alone = download(y, N);
    float* yb = upload(y0_row);
    be().matmul_bf16_nt(yb, upload(row_b), wbd, 1, N, K, alpha, true);
    const std::vector<float> alone_b = download(yb, N);
    {
      std::vector<float> ref(static_cast<size_t>(N));
      cpu::matmul_nt(ref.data(), row.data(), w.data(), 1, N, K, false);
      std::vector<double> ra(row.begin(), row.end()), wa(w.begin(), w.end()), mag(static_cast<size_t>(N));
      for (double& v : ra) v = std::fabs(v);
      for (double& v : wa) v = std::fabs(v);
      cpu::matmul_nt(mag.data(), ra.data(), wa.data(), 1, N, K, false);
      std::vector<double> bound(mag.size());
      for (size_t i = 0; i < mag.size(); ++i) bound[i] = double(3 * K + 6) * kUnitRoundoff * mag[i];
      EXPECT_TRUE(within_bound(alone, ref, bound)) << "N=" << N << " K=" << K;
    }
    for (int64_t M : {2, 5, 13}) {
      for (int64_t at : {int64_t{0}, M / 2, M - 1}) {
        std::vector<float> x = normal_vector(M * K, seed += 7), y0 = normal_vector(M * N, seed += 7);
        std::copy(row.begin(), row.end(), x.begin() + at * K);
        std::copy(y0_row.begin(), y0_row.end(), y0.begin() + at * N);
        std::vector<uint16_t> x_b(x.size());
        for (size_t i = 0; i < x.size(); ++i) x_b[i] = f32_to_bf16_bits(x[i]);
        float* ym = zeros<float>(M * N);
        be().matmul_nt(ym, upload(x), wd, M, N, K, false, false);
        const std::vector<float> got = download(ym, M * N);
        EXPECT_TRUE(bits_equal(std::vector<float>(got.begin() + at * N, got.begin() + (at + 1) * N), alone))
            << "fp32 N=" << N << " K=" << K << " M=" << M << " row " << at;
        float* ymb = upload(y0);
        be().matmul_bf16_nt(ymb, upload(x_b), wbd, M, N, K, alpha, true);
        const std::vector<float> got_b = download(ymb, M * N);
        EXPECT_TRUE(bits_equal(std::vector<float>(got_b.begin() + at * N, got_b.begin() + (at + 1) * N), alone_b))
            << "bf16 N=" << N << " K=" << K << " M=" << M << " row " << at;
      }
    }
  }
}

NIB_INSTANTIATE_OPS_TEST(GemmOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
