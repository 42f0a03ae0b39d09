// Op tests of Backend::greedy_rows (the rollout engine's greedy decoding where the logits are) on
// every backend: against a readable sequential reference (the host sampler's scan for the token;
// core/softmax_f64.h's max and lane-ordered exp sum for the stats) bit for bit, at the OLMo-2 1B
// vocabulary (100352, a multiple of neither the kernel's tile nor of 8 past its tiles: 100352 =
// 49 * 2048) and small ones (V < 8, V = 2049), with ties (the first index wins), NaN logits (never
// the largest; one at index 0 gives token 0), a row of -inf and one of +inf. The log-prob formed
// from the stats is checked against a long-double log-softmax within a derived bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "backend/ops_test/ops_test_util.h"
#include "core/softmax_f64.h"

namespace nibble::backend::testing {
namespace {

class GreedyRowsOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kGreedyRows)) GTEST_SKIP() << "backend '" << be().name() << "' has no greedy_rows";
  }
};

// The reference: the host sampler's greedy scan and softmax sums (rollout/sampler.cpp).
void reference_row(const float* l, int64_t V, int32_t* token, double* st) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (l[i] > l[best]) best = i;
  *token = static_cast<int32_t>(best);
  const double mx = softmax_scaled_max(l, V, 1.0);
  st[0] = static_cast<double>(l[best]);
  st[1] = mx;
  st[2] = softmax_exp_sum(l, V, 1.0, mx);
}

TEST_P(GreedyRowsOpsTest, TokenAndSoftmaxSumsEqualTheHostSamplersBits) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const int64_t V : {int64_t{5}, int64_t{8}, int64_t{2049}, int64_t{100352}}) {
    SCOPED_TRACE(fmt::format("V={}", V));
    constexpr int64_t kRows = 9;
    std::vector<float> x = normal_vector(kRows * V, 17 + V, 3.0);
    float* r = x.data();
    // row 1: a tie of the largest value at two indices (the first wins), row 2: NaNs (one at the
    // end, one in the middle), row 3: NaN at index 0, row 4: all -inf, row 5: a +inf, row 6: all
    // equal, row 7: the largest at the last index, row 8: large logits (exp underflow to 0 terms)
    r[1 * V + V / 2] = 50.0f, r[1 * V + V - 1] = 50.0f;
    r[2 * V + V - 1] = nan, r[2 * V + V / 3] = nan;
    r[3 * V + 0] = nan;
    for (int64_t i = 0; i < V; ++i) r[4 * V + i] = -inf;
    r[5 * V + V / 4] = inf;
    for (int64_t i = 0; i < V; ++i) r[6 * V + i] = 0.25f;
    r[7 * V + V - 1] = 40.0f;
    for (int64_t i = 0; i < V; ++i) r[8 * V + i] *= 300.0f;
    std::vector<int32_t> ref_tok(kRows);
    std::vector<double> ref_st(3 * kRows);
    for (int64_t row = 0; row < kRows; ++row) reference_row(r + row * V, V, &ref_tok[row], &ref_st[3 * row]);
    int32_t* tok_dev = zeros<int32_t>(kRows);
    double* st_dev = zeros<double>(3 * kRows);
    be().greedy_rows(tok_dev, st_dev, upload(x), kRows, V);
    const std::vector<int32_t> tok = download(tok_dev, kRows);
    const std::vector<double> st = download(st_dev, 3 * kRows);
    for (int64_t row = 0; row < kRows; ++row) {
      SCOPED_TRACE(fmt::format("row {}", row));
      EXPECT_EQ(tok[row], ref_tok[row]);
      for (int j = 0; j < 3; ++j) {  // bit for bit; a NaN (the +inf row's z) as any NaN (payloads differ by ISA)
        const bool both_nan = std::isnan(st[3 * row + j]) && std::isnan(ref_st[3 * row + j]);
        EXPECT_TRUE(both_nan || std::memcmp(&st[3 * row + j], &ref_st[3 * row + j], sizeof(double)) == 0)
            << "stat " << j << ": " << st[3 * row + j] << " vs " << ref_st[3 * row + j];
      }
    }
    EXPECT_EQ(tok[1], V > 2 ? V / 2 : ref_tok[1]);
    EXPECT_EQ(tok[3], 0);
    EXPECT_EQ(tok[7], V - 1);
    // log p = stats0 - mx - log z against a long-double log-softmax of the ordinary rows: exp_f64
    // is within 2 ulp, the V-term sum adds at most (V + 2) u relative, log and the two
    // subtractions a few ulp of |terms| <= 60: bound 4e-13 + (V + 8) 2^-53 in absolute terms.
    for (int64_t row : {int64_t{0}, int64_t{1}, int64_t{7}}) {
      const float* l = r + row * V;
      long double m = -INFINITY, sum = 0;
      for (int64_t i = 0; i < V; ++i) m = std::max<long double>(m, l[i]);
      for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<long double>(l[i]) - m);
      const long double want = static_cast<long double>(l[tok[row]]) - m - std::log(sum);
      const double got = st[3 * row] - st[3 * row + 1] - std::log(st[3 * row + 2]);
      EXPECT_NEAR(got, static_cast<double>(want), 4e-13 + static_cast<double>(V + 8) * 0x1.0p-53) << "row " << row;
    }
  }
}

NIB_INSTANTIATE_OPS_TEST(GreedyRowsOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
