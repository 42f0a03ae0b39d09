// Op tests of the optimizer ops: AdamW on a flat range, checked bit for bit against a scalar
// reference written here from train/optimizer.cpp (PyTorch's single-tensor AdamW, FP32 element
// arithmetic, scalars from doubles), over several steps with and without weight decay and with
// a gradient scale; and the sum of squares behind the global gradient norm (double, fixed order
// per backend; between backends the orders differ, bounded as written beside the case); the
// multi-tensor forms give each range's single-call bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/ops_test/ops_test_util.h"
#include "backend/ops_test/tolerance_util.h"

namespace nibble::backend::testing {
namespace {

// The reference update of train/optimizer.cpp, element by element.
void adamw_reference(std::vector<float>& w, std::vector<float>& m, std::vector<float>& v, const std::vector<float>& g,
                     const AdamWStep& s) {
  const float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  const float one_minus_b1 = static_cast<float>(1.0 - s.beta1);
  const float b2 = static_cast<float>(s.beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const float step_size = static_cast<float>(s.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(s.eps);
  for (size_t i = 0; i < w.size(); ++i) {
    const float gi = g[i] * s.grad_scale;
    float wi = w[i];
    if (s.weight_decay != 0.0) wi = wi * decay;
    m[i] = m[i] + one_minus_b1 * (gi - m[i]);
    v[i] = v[i] * b2 + one_minus_b2 * (gi * gi);
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    w[i] = wi + (-step_size) * (m[i] / denom);
  }
}

class OptimizerOpsTest : public OpsTest {};

TEST_P(OptimizerOpsTest, AdamWMatchesTheReferenceBitForBit) {
  const int64_t n = 1001;
  for (double wd : {0.0, 0.1}) {
    std::vector<float> w = normal_vector(n, 1), m(n, 0.0f), v(n, 0.0f);
    float* wd_ = upload(w);
    float* md = upload(m);
    float* vd = upload(v);
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<float> g = normal_vector(n, 10 + step, 0.01 * double(step));
      if (step == 2) g[5] = 0.0f, g[6] = -1e-30f;  // zero and tiny gradients
      AdamWStep s;
      s.lr = 3e-4 * double(step), s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = wd, s.step = step;
      s.grad_scale = step == 3 ? 0.37f : 1.0f;
      adamw_reference(w, m, v, g, s);
      be().adamw_update(wd_, md, vd, upload(g), n, s);
      EXPECT_TRUE(bits_equal(download(wd_, n), w)) << "w, step " << step << " wd " << wd;
      EXPECT_TRUE(bits_equal(download(md, n), m)) << "m, step " << step << " wd " << wd;
      EXPECT_TRUE(bits_equal(download(vd, n), v)) << "v, step " << step << " wd " << wd;
    }
  }
}

// The terms double(g * scale)^2 are the same on every backend; each backend adds them in its
// own fixed order, within (n - 1) 2^-53 of the exact sum of these positive terms, as is the
// sequential sum here, so they differ by at most 2 n 2^-53 times the sum. Deterministic: a
// second call gives the same bits.
TEST_P(OptimizerOpsTest, SumSquaresFixedOrder) {
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{300007}}) {
    std::vector<float> g = normal_vector(n, 20 + n, 3.0);
    const float scale = 0.5f;
    double seq = 0;  // the sequential double sum
    for (float x : g) {
      const double t = static_cast<double>(x * scale);
      seq += t * t;
    }
    const float* gd = upload(g);
    const double got = be().sum_squares(gd, n, scale);
    EXPECT_LE(std::fabs(got - seq), 2.0 * double(n) * kUnitRoundoffF64 * seq) << "n=" << n;
    const double again = be().sum_squares(gd, n, scale);
    EXPECT_EQ(std::memcmp(&got, &again, sizeof got), 0) << "n=" << n;
  }
  EXPECT_EQ(be().sum_squares(upload(std::vector<float>{0.0f}), 0, 1.0f), 0.0);
}

// Per-chunk sums (the global-norm clip's pieces): each chunk's sum is within (len - 1) 2^-53 of
// its exact sum of positive terms, as is the sequential sum here: at most 2 len 2^-53 apart.
// The count of pieces and the last, shorter piece are checked; a second call repeats the bits.
TEST_P(OptimizerOpsTest, SumSquaresChunksPerPiece) {
  const int64_t n = 200003, chunk = 65536;  // 3 full pieces and one of 3395
  std::vector<float> g = normal_vector(n, 77, 2.0);
  const float scale = 0.25f;
  const float* gd = upload(g);
  std::vector<double> got(4, -1.0), again(4, -1.0);
  be().sum_squares_chunks(got.data(), gd, n, chunk, scale);
  be().sum_squares_chunks(again.data(), gd, n, chunk, scale);
  for (int64_t c = 0; c < 4; ++c) {
    const int64_t b = c * chunk, e = std::min(n, b + chunk);
    double seq = 0;
    for (int64_t i = b; i < e; ++i) {
      const double t = static_cast<double>(g[i] * scale);
      seq += t * t;
    }
    EXPECT_LE(std::fabs(got[c] - seq), 2.0 * double(e - b) * kUnitRoundoffF64 * seq) << "piece " << c;
    EXPECT_EQ(std::memcmp(&got[c], &again[c], sizeof(double)), 0) << "piece " << c;
  }
}

// The whole parameter list in one call: many ranges of ragged sizes (empty ones, one element,
// off and at the tile and chunk sizes), mixed weight decay: each range gets exactly the bits of
// its own adamw_update / sum_squares_chunks call on the same backend.
TEST_P(OptimizerOpsTest, MultiRangeFormsEqualOneCallPerRange) {
  const std::vector<int64_t> sizes = {1000, 0, 1, 4096, 4097, 65536, 65537 + 3, 0, 300, 131072, 17};
  const int64_t count = static_cast<int64_t>(sizes.size()), chunk = 65536;
  std::vector<float*> w1, m1, v1, w2, m2, v2;
  std::vector<const float*> g;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = std::max<int64_t>(sizes[r], 1);  // an empty range still gets a valid pointer
    const std::vector<float> w0 = normal_vector(n, 300 + r), mv0 = normal_vector(n, 400 + r, 0.01);
    std::vector<float> v0(mv0.size());
    for (size_t i = 0; i < v0.size(); ++i) v0[i] = mv0[i] * mv0[i];
    w1.push_back(upload(w0)), m1.push_back(upload(mv0)), v1.push_back(upload(v0));
    w2.push_back(upload(w0)), m2.push_back(upload(mv0)), v2.push_back(upload(v0));
    g.push_back(upload(normal_vector(n, 500 + r, 0.02)));
  }
  AdamWStep s;
  s.lr = 1e-3, s.weight_decay = 0.1, s.step = 7, s.grad_scale = 0.8f;
  std::vector<AdamWRange> ranges;
  for (int64_t r = 0; r < count; ++r) {
    ranges.push_back(AdamWRange{w2[r], m2[r], v2[r], g[r], sizes[r], r % 3 != 1});
    AdamWStep one = s;
    one.weight_decay = r % 3 != 1 ? s.weight_decay : 0.0;
    if (sizes[r] > 0) be().adamw_update(w1[r], m1[r], v1[r], g[r], sizes[r], one);
  }
  be().adamw_update_multi(ranges.data(), count, s);
  int64_t pieces = 0;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = std::max<int64_t>(sizes[r], 1);
    EXPECT_TRUE(bits_equal(download(w2[r], n), download(w1[r], n))) << "w of range " << r;
    EXPECT_TRUE(bits_equal(download(m2[r], n), download(m1[r], n))) << "m of range " << r;
    EXPECT_TRUE(bits_equal(download(v2[r], n), download(v1[r], n))) << "v of range " << r;
    pieces += (sizes[r] + chunk - 1) / chunk;
  }
  std::vector<double> multi(static_cast<size_t>(pieces), -1.0), single;
  be().sum_squares_chunks_multi(multi.data(), g.data(), sizes.data(), count, chunk, 0.5f);
  for (int64_t r = 0; r < count; ++r) {
    std::vector<double> part(static_cast<size_t>((sizes[r] + chunk - 1) / chunk), -2.0);
    if (sizes[r] > 0) be().sum_squares_chunks(part.data(), g[r], sizes[r], chunk, 0.5f);
    single.insert(single.end(), part.begin(), part.end());
  }
  ASSERT_EQ(multi.size(), single.size());
  EXPECT_EQ(0, std::memcmp(multi.data(), single.data(), multi.size() * sizeof(double)));
}

NIB_INSTANTIATE_OPS_TEST(OptimizerOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
