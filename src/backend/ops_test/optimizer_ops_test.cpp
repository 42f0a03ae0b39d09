// Op tests of the optimizer ops: AdamW on a flat range, checked bit for bit against a scalar
// reference written here from train/optimizer.cpp (PyTorch's single-tensor AdamW, FP32 element
// arithmetic, scalars from doubles), over several steps with and without weight decay and with
// a gradient scale; and the sum of squares behind the global gradient norm (double, fixed order
// per backend; between backends the orders differ, bounded as written beside the case).
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

NIB_INSTANTIATE_OPS_TEST(OptimizerOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
