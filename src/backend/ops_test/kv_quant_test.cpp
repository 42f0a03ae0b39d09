// Op test of the trainer's NVFP4 KV-cache step (model/kv_quantizer.h) on every backend: the
// two-level quantizer over the (N*Hkv, D) matrix of keys or values (Backend::quantize with
// kNvfp4TwoLevel), then Backend::dequantize, must give bit for bit what the rollout engine's
// pages hold after Backend::kv_cache_write in the nvfp4 format (backend/kv_page_codec.h) on the
// same backend: the same codes, E4M3 and FP32 scales, and the same values as the pages decode
// to. Head dims 16, 64 (one short 128-block), 144 (a 16-wide second block) and 256 (two full).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "backend/kv_page_codec.h"
#include "backend/ops_test/ops_test_util.h"

namespace nibble::backend::testing {
namespace {

class KvQuantOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kPagedKvCache))
      GTEST_SKIP() << "backend '" << be().name() << "' has no paged KV-cache ops yet (issue #15)";
  }
};

TEST_P(KvQuantOpsTest, TwoLevelRoundTripEqualsTheNvfp4PageCodec) {
  for (int64_t D : {16, 64, 144, 256}) {
    SCOPED_TRACE(fmt::format("D={}", D));
    const int64_t N = 7, Hkv = 2, rows = N * Hkv;
    // heads of magnitudes 2^-6 .. 2^5 (scales over a wide range), a zero row, a row with one outlier
    std::vector<float> x = normal_vector(rows * D, 40 + static_cast<uint64_t>(D));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) x[r * D + d] = std::ldexp(x[r * D + d], static_cast<int>(r % 12) - 6);
    for (int64_t d = 0; d < D; ++d) x[3 * D + d] = 0.0f;
    x[5 * D + 7] *= 300.0f;
    // the engine: slots in a shuffled order of a 3-page x 4-position cache
    const std::vector<int32_t> slots = {9, 2, 11, 0, 5, 7, 3};
    const int64_t tb = kv_token_bytes(KvPageFormat::kNvfp4, Hkv, D), nslots = 12;
    uint8_t* kp = zeros<uint8_t>(nslots * tb);
    uint8_t* vp = zeros<uint8_t>(nslots * tb);
    const float* xd = upload(x);
    be().kv_cache_write(kp, vp, KvPageFormat::kNvfp4, xd, xd, upload(slots), N, Hkv, D);
    const std::vector<uint8_t> pages = download(kp, nslots * tb);
    // the trainer's step
    QuantizedBuffer buf;
    QuantizedTensor q = buf.view(be(), QuantFormat::kNvfp4TwoLevel, rows, D);
    float* y = upload(x);
    be().quantize(q, y);
    be().dequantize(y, q);
    const std::vector<float> got = download(y, rows * D);
    const std::vector<uint8_t> codes = download(q.codes, rows * D / 2), inner = download(q.scales, rows * D / 16);
    const int64_t opr = (D + 127) / 128;
    const std::vector<float> outer = download(q.outer, rows * opr);
    const kv::TokenLayout L = kv::token_layout(KvPageFormat::kNvfp4, Hkv, D);
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* slot = pages.data() + slots[n] * tb;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t r = n * Hkv + h;
        ASSERT_EQ(0, std::memcmp(codes.data() + r * D / 2, slot + L.codes + h * D / 2, static_cast<size_t>(D / 2)))
            << "codes of token " << n << " head " << h;
        ASSERT_EQ(0, std::memcmp(inner.data() + r * D / 16, slot + L.inner + h * D / 16, static_cast<size_t>(D / 16)))
            << "inner scales of token " << n << " head " << h;
        ASSERT_EQ(0, std::memcmp(outer.data() + r * opr, slot + L.scales + 4 * h * opr, static_cast<size_t>(4 * opr)))
            << "outer scales of token " << n << " head " << h;
        for (int64_t d = 0; d < D; ++d) {
          const float page = kv::decode_element(slot, L, KvPageFormat::kNvfp4, D, h, d);
          ASSERT_EQ(std::memcmp(&got[r * D + d], &page, 4), 0)
              << "token " << n << " head " << h << " element " << d << ": " << got[r * D + d] << " vs " << page;
        }
      }
    }
  }
}

NIB_INSTANTIATE_OPS_TEST(KvQuantOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
