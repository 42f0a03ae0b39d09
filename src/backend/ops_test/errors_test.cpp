// How a backend reports failures (issue 13 item 6): running out of memory names what was being
// allocated, the size and the config keys to lower; a failed op names the op, its shapes and the
// device; an id out of range met by a kernel is reported at the next synchronisation, not read
// out of bounds. These are the CUDA backend's cases (they skip on "cpu": the CPU backend checks
// ids before it loops, throwing at once, and allocates host memory).
#include <cstdint>
#include <string>
#include <vector>

#include "backend/ops_test/ops_test_util.h"
#include "core/check.h"

namespace nibble::backend::testing {
namespace {

class ErrorsOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (!IsSkipped() && be().device() != Device::kCUDA) GTEST_SKIP() << "CUDA backend cases";
  }
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST_P(ErrorsOpsTest, OutOfMemoryNamesWhatAndWhichKeysToLower) {
  Result<void*> r = be().allocate(size_t{1} << 50, "activations of layer 3");  // 1 PiB
  ASSERT_FALSE(r.is_ok());
  const std::string& m = r.status().message();
  EXPECT_TRUE(contains(m, "activations of layer 3")) << m;
  EXPECT_TRUE(contains(m, "1125899906842624 bytes")) << m;
  EXPECT_TRUE(contains(m, "GiB free")) << m;
  EXPECT_TRUE(contains(m, "batch_size")) << m;  // the run config's keys to lower
  EXPECT_TRUE(contains(m, "seq_len")) << m;
  EXPECT_TRUE(contains(m, be().name())) << m;
  // The backend still works afterwards.
  std::vector<float> x{1.0f, 2.0f};
  EXPECT_TRUE(bits_equal(download(upload(x), 2), x));
}

TEST_P(ErrorsOpsTest, BadShapeNamesTheOpTheShapeAndTheDevice) {
  QuantizedBuffer qb;
  QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, 3, 40);  // 40 % 16 != 0
  const float* x = zeros<float>(3 * 40);
  try {
    be().quantize(q, x, nullptr);
    ADD_FAILURE() << "quantize of a 3x40 nvfp4-2level tensor did not fail";
  } catch (const CheckError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(contains(m, "quantize")) << m;
    EXPECT_TRUE(contains(m, "3x40")) << m;
    EXPECT_TRUE(contains(m, be().name())) << m;
  }
}

TEST_P(ErrorsOpsTest, TokenOutOfRangeIsReportedAtTheNextSync) {
  const int64_t N = 4, V = 10, C = 8;
  const float* wte = zeros<float>(V * C);
  float* out = zeros<float>(N * C);
  be().embedding_forward(out, upload(std::vector<int32_t>{1, 2, 10, 3}), wte, N, V, C);
  try {
    be().synchronize();
    ADD_FAILURE() << "token 10 >= V = 10 was not reported";
  } catch (const CheckError& e) {
    EXPECT_TRUE(contains(e.what(), "token id")) << e.what();
  }
  be().synchronize();  // reported once: the flag is cleared
}

TEST_P(ErrorsOpsTest, TargetOutOfRangeFailsTheLoss) {
  const int64_t N = 3, V = 5;
  const float* logits = zeros<float>(N * V);
  float* lse = zeros<float>(N);
  EXPECT_THROW(be().cross_entropy_forward(lse, nullptr, logits, upload(std::vector<int32_t>{0, 7, -100}), N, V),
               CheckError);
  const backend::CrossEntropySums s =
      be().cross_entropy_forward(lse, nullptr, logits, upload(std::vector<int32_t>{0, 4, -100}), N, V);
  EXPECT_EQ(s.n_valid, 2);
  // sums left in backend memory: the bad target is reported at the next synchronisation at the latest
  double* sums = zeros<double>(4);
  EXPECT_THROW(
      {
        be().cross_entropy_forward_sums(sums, lse, nullptr, logits, upload(std::vector<int32_t>{7, 0, 1}), N, V);
        be().synchronize();
      },
      CheckError);
  be().cross_entropy_forward_sums(sums, lse, nullptr, logits, upload(std::vector<int32_t>{0, 4, -100}), N, V);
  EXPECT_EQ(download(sums, 4)[2], 2.0);  // reported once: the flag is cleared
}

NIB_INSTANTIATE_OPS_TEST(ErrorsOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
