// Op tests of Backend::guided_overwrite_rows (the RL trainer's TRACE guided rounding of gathered
// rows, Op::kTraceGuidedRows) on every backend that has it: q is the backend's own RTN
// quantization of x; the rollout's scales and codes come from a perturbed copy of x (so its codes
// differ from the trainer's RTN on some elements), full codes or mantissa bits; a scattered,
// unsorted subset of rows is re-rounded. The codes, inner and outer scales of the whole tensor and
// the three counts must equal, bit for bit, a readable scalar reference written here from the
// definition (01-formats.md §7: the two E2M1 neighbours of |x| / s_roll, the one the rollout's
// code or mantissa bit selects); shapes with a partial 128-block and more 16-blocks than one CUDA
// thread block holds. guidance_payload_rows (the rollout recorder's record payloads) against the
// bytes assembled from the backend's own quantization.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/ops_test/ops_test_util.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/quantize_cpu.h"

namespace nibble::backend::testing {
namespace {

class GuidedRowsOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kTraceGuidedRows)) GTEST_SKIP() << "backend '" << be().name() << "' has no guided rows op";
  }
};

constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// The readable definition of one guided element: a = min(|x| / sp, 6) (sp == 0: 0), its grid
// neighbours down <= a <= up; full guidance takes the one whose signed value is nearer the
// rollout's value, 1-bit guidance the one whose index has the rollout's mantissa bit.
uint32_t reference_guided_code(float x, float sp, uint32_t guide, bool full) {
  const bool neg = std::signbit(x);
  float a = sp == 0.0f ? 0.0f : std::fabs(x) / sp;
  a = std::min(a, 6.0f);
  uint32_t down = 0, up = 7;
  for (uint32_t i = 0; i < 8; ++i) {
    if (kGrid[i] <= a) down = i;
    if (kGrid[7 - i] >= a) up = 7 - i;
  }
  uint32_t idx;
  if (full) {
    const float roll = (guide & 8u) ? -kGrid[guide & 7u] : kGrid[guide & 7u];
    const float vd = neg ? -kGrid[down] : kGrid[down], vu = neg ? -kGrid[up] : kGrid[up];
    idx = std::fabs(vd - roll) <= std::fabs(vu - roll) ? down : up;
  } else {
    idx = (down & 1u) == guide ? down : up;
  }
  return idx | (neg ? 8u : 0u);
}

int signed_index(uint32_t c) { return (c & 8u) ? -static_cast<int>(c & 7u) : static_cast<int>(c & 7u); }

struct Shape {  // M rows of K columns
  int64_t M, K;
};

TEST_P(GuidedRowsOpsTest, EqualsTheReadableReferenceBitForBit) {
  for (Shape s : {Shape{5, 16}, Shape{37, 144}, Shape{300, 256}})
    for (const bool full : {true, false}) {
      SCOPED_TRACE(fmt::format("M={} K={} {}", s.M, s.K, full ? "trace-full" : "trace"));
      const int64_t M = s.M, K = s.K, kb = K / 16, no = (K + 127) / 128;
      // rows of different magnitudes; the rollout saw x perturbed by ~1% (its own scales and codes)
      std::vector<float> x = normal_vector(M * K, 71 + K, 1.0), xr(x.size());
      const std::vector<float> noise = normal_vector(M * K, 73 + K, 0.01);
      for (int64_t i = 0; i < M * K; ++i) {
        x[i] = std::ldexp(x[i], static_cast<int>((i / K) % 9) - 4);
        xr[i] = x[i] * (1.0f + noise[i]);
      }
      // rows re-rounded: every third row, in descending order, and row 1
      std::vector<int32_t> rows;
      for (int64_t m = M - 1; m >= 0; --m)
        if (m % 3 == 0 || m == 1) rows.push_back(static_cast<int32_t>(m));
      const auto R = static_cast<int64_t>(rows.size());
      std::vector<uint8_t> roll_codes(M * K / 2), roll_inner(M * kb);
      std::vector<float> roll_outer(M * no);
      formats::nvfp4_2level_quantize_cpu(roll_codes.data(), roll_inner.data(), roll_outer.data(), xr.data(), M, K);
      const int64_t gstride = full ? K / 2 : K / 8;
      std::vector<uint8_t> scales(R * kb), guide(R * gstride);
      std::vector<float> outer(R * no);
      for (int64_t i = 0; i < R; ++i) {
        const int64_t m = rows[i];
        std::copy_n(roll_inner.data() + m * kb, kb, scales.data() + i * kb);
        std::copy_n(roll_outer.data() + m * no, no, outer.data() + i * no);
        if (full)
          std::copy_n(roll_codes.data() + m * K / 2, K / 2, guide.data() + i * gstride);
        else
          formats::e2m1_mantissa_bits_cpu(guide.data() + i * gstride, roll_codes.data() + m * K / 2, 1, K);
      }

      float* x_dev = upload(x);
      QuantizedBuffer qb;
      QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, M, K);
      be().quantize(q, x_dev);  // the trainer's RTN
      std::vector<uint8_t> codes = download(q.codes, M * K / 2), inner = download(q.scales, M * kb);
      std::vector<float> qouter = download(q.outer, M * no);

      // the reference on host copies
      int64_t ref_stats[3] = {0, 0, 0};
      for (int64_t i = 0; i < R; ++i) {
        const int64_t m = rows[i];
        for (int64_t c = 0; c < K; ++c) {
          const float sp = formats::e4m3_decode(scales[i * kb + c / 16]) * outer[i * no + c / 128];
          const uint32_t g = full ? formats::e2m1_unpack(guide.data() + i * gstride, c)
                                  : (guide[i * gstride + c / 8] >> (c % 8)) & 1u;
          const uint32_t gc = reference_guided_code(x[m * K + c], sp, g, full);
          const uint32_t own = formats::e2m1_unpack(codes.data() + m * K / 2, c);
          const uint32_t roll = full ? g : gc;
          const bool zero_pair = (own & 7u) == 0 && (roll & 7u) == 0;
          const bool mismatch = own != roll && !zero_pair;
          ref_stats[0] += mismatch;
          ref_stats[1] += mismatch && std::abs(signed_index(own) - signed_index(roll)) == 1;
          ref_stats[2] += full ? (gc == g || ((gc & 7u) == 0 && (g & 7u) == 0)) : (gc & 1u) == g;
          uint8_t& byte = codes[m * K / 2 + c / 2];
          byte = static_cast<uint8_t>((c % 2) ? ((byte & 0x0Fu) | (gc << 4)) : ((byte & 0xF0u) | gc));
        }
        std::copy_n(scales.data() + i * kb, kb, inner.data() + m * kb);
        std::copy_n(outer.data() + i * no, no, qouter.data() + m * no);
      }
      ASSERT_GT(ref_stats[0], 0);  // the perturbation makes the trainer's RTN differ somewhere
      ASSERT_GT(ref_stats[2], 0);

      int64_t* stats_dev = zeros<int64_t>(3);
      be().guided_overwrite_rows(q, stats_dev, x_dev, upload(rows), R, upload(scales), upload(outer), upload(guide),
                                 full ? formats::GuidanceKind::kFull : formats::GuidanceKind::kMantissaBit);
      const std::vector<int64_t> st = download(stats_dev, 3);
      EXPECT_EQ(st[0], ref_stats[0]);
      EXPECT_EQ(st[1], ref_stats[1]);
      EXPECT_EQ(st[2], ref_stats[2]);
      EXPECT_TRUE(bits_equal(download(q.codes, M * K / 2), codes));
      EXPECT_TRUE(bits_equal(download(q.scales, M * kb), inner));
      EXPECT_TRUE(bits_equal(download(q.outer, M * no), qouter));
    }
}

// guidance_payload_rows: row r = inner scales | outer (little-endian f32 bytes) | codes or their
// mantissa bits, against the bytes assembled here from the backend's own quantization.
TEST_P(GuidedRowsOpsTest, PayloadRowsHoldTheScalesAndTheCodesOrTheirMantissaBits) {
  for (Shape s : {Shape{3, 16}, Shape{21, 144}, Shape{130, 256}})
    for (const bool full : {true, false}) {
      SCOPED_TRACE(fmt::format("M={} K={} {}", s.M, s.K, full ? "trace-full" : "trace"));
      const int64_t M = s.M, K = s.K, kb = K / 16, no = (K + 127) / 128, P = kb + 4 * no + (full ? K / 2 : K / 8);
      std::vector<float> x = normal_vector(M * K, 91 + K, 1.0);
      for (int64_t i = 0; i < M * K; ++i) x[i] = std::ldexp(x[i], static_cast<int>((i / K) % 5) - 2);
      QuantizedBuffer qb;
      QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, M, K);
      be().quantize(q, upload(x));
      const std::vector<uint8_t> codes = download(q.codes, M * K / 2), inner = download(q.scales, M * kb);
      const std::vector<float> outer = download(q.outer, M * no);
      std::vector<uint8_t> ref(static_cast<size_t>(M * P), 0);
      for (int64_t r = 0; r < M; ++r) {
        uint8_t* p = ref.data() + r * P;
        for (int64_t b = 0; b < kb; ++b) p[b] = inner[r * kb + b];
        for (int64_t o = 0; o < no; ++o) {
          uint32_t u;
          std::memcpy(&u, &outer[r * no + o], 4);
          for (int j = 0; j < 4; ++j) p[kb + 4 * o + j] = static_cast<uint8_t>(u >> (8 * j));
        }
        for (int64_t c = 0; c < K; ++c) {
          const uint32_t code = formats::e2m1_unpack(codes.data() + r * K / 2, c);
          if (full)
            p[kb + 4 * no + c / 2] |= static_cast<uint8_t>(code << (4 * (c % 2)));
          else
            p[kb + 4 * no + c / 8] |= static_cast<uint8_t>((code & 1u) << (c % 8));
        }
      }
      uint8_t* out = zeros<uint8_t>(M * P);
      be().guidance_payload_rows(out, q, full ? formats::GuidanceKind::kFull : formats::GuidanceKind::kMantissaBit);
      EXPECT_TRUE(bits_equal(download(out, M * P), ref));
    }
}

// A tensor that is not two-level NVFP4 is refused by name on every backend (one line, no kernel).
TEST_P(GuidedRowsOpsTest, AnotherFormatIsRefusedNamingTheOp) {
  QuantizedBuffer qb;
  QuantizedTensor q = qb.view(be(), QuantFormat::kMxfp8, 2, 64);
  int64_t* stats = zeros<int64_t>(3);
  float* x = zeros<float>(2 * 64);
  const std::vector<int32_t> rows = {1};
  try {
    be().guided_overwrite_rows(q, stats, x, upload(rows), 1, zeros<uint8_t>(4), zeros<float>(1), zeros<uint8_t>(32),
                               formats::GuidanceKind::kFull);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("guided_overwrite_rows"), std::string::npos) << e.what();
  }
  try {
    be().guidance_payload_rows(zeros<uint8_t>(2 * 64), q, formats::GuidanceKind::kFull);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("guidance_payload_rows"), std::string::npos) << e.what();
  }
}

NIB_INSTANTIATE_OPS_TEST(GuidedRowsOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
