// The seam itself on every backend: the registry, memory round trips, grow-only buffers and the
// byte layout of quantized operands (QuantizedBuffer views).
#include <gtest/gtest.h>

#include "backend/ops_test/ops_test_util.h"

namespace nibble::backend::testing {
namespace {

class SeamTest : public OpsTest {};

TEST_P(SeamTest, CopiesRoundTripExactly) {
  std::vector<float> host = normal_vector(1001, 7);
  float* d = upload(host);
  std::vector<float> back = download(d, 1001);
  EXPECT_TRUE(bits_equal(back, host));
  float* z = zeros<float>(33);
  be().copy(z, d + 5, 33 * sizeof(float));
  EXPECT_TRUE(bits_equal(download(z, 33), std::vector<float>(host.begin() + 5, host.begin() + 38)));
}

TEST_P(SeamTest, BufferGrowsOnlyWhenAskedForMore) {
  Buffer<float> b;
  float* p1 = b.ensure(be(), 100, "test buffer");
  float* p2 = b.ensure(be(), 50, "test buffer");
  EXPECT_EQ(p1, p2);  // no reallocation for a smaller request
  EXPECT_EQ(b.size(), 100);
  b.ensure(be(), 1000, "test buffer");
  EXPECT_EQ(b.size(), 1000);
}

TEST_P(SeamTest, QuantizedBufferViewSizes) {
  QuantizedBuffer qb;
  QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, 4, 272);  // 272 = 2*128 + 16
  EXPECT_EQ(qb.codes.size(), 4 * 272 / 2);
  EXPECT_EQ(qb.scales.size(), 4 * 272 / 16);
  EXPECT_EQ(qb.outer.size(), 4 * 3);  // ceil(272/128) = 3 outer scales per row
  EXPECT_NE(q.outer, nullptr);
  QuantizedTensor m = qb.view(be(), QuantFormat::kMxfp8, 2, 64);
  EXPECT_EQ(m.outer, nullptr);
  EXPECT_EQ(QuantizedTensor::code_bytes(QuantFormat::kMxfp8, 2, 64), 128);
  EXPECT_EQ(QuantizedTensor::scale_bytes(QuantFormat::kMxfp8, 2, 64), 4);
  EXPECT_EQ(QuantizedTensor::outer_count(QuantFormat::kNvfp4Te, 2, 64), 1);
}

// A buffer that cannot grow throws the backend's one-line message (what, size, keys to lower),
// not an internal check with a source position (the CLI prints it as it is).
TEST_P(SeamTest, BufferOutOfMemoryIsTheBackendsMessage) {
  Buffer<float> huge;
  try {
    huge.ensure(be(), int64_t{1} << 48, "saved activations");  // 1 PiB of floats
    ADD_FAILURE() << "a 1 PiB buffer was allocated";
  } catch (const AllocationError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("saved activations"), std::string::npos) << m;
    EXPECT_NE(m.find("batch_size"), std::string::npos) << m;
    EXPECT_EQ(m.find("check failed"), std::string::npos) << m;
    EXPECT_EQ(m.find(".h:"), std::string::npos) << m;
  }
}

TEST_P(SeamTest, MemoryStatsCountLiveAndPeakBytes) {
  Backend::MemoryStats before = be().memory_stats();
  ASSERT_GE(before.in_use_bytes, 0) << be().name() << " tracks no memory";
  be().reset_peak_memory();
  {
    Buffer<float> big;
    big.ensure(be(), 1 << 20, "stats test");  // 4 MiB
    Backend::MemoryStats during = be().memory_stats();
    EXPECT_GE(during.in_use_bytes - before.in_use_bytes, 4 << 20);
  }
  be().synchronize();
  Backend::MemoryStats after = be().memory_stats();
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);  // freed again
  EXPECT_GE(after.peak_bytes - before.in_use_bytes, 4 << 20);  // the peak remembers it
}

NIB_INSTANTIATE_OPS_TEST(SeamTest);

TEST(BackendRegistry, UnknownDeviceNamesWhatExists) {
  auto r = make_backend("tpu");
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("available: cpu"), std::string::npos) << r.status().message();
  auto bad = make_backend("cuda:x");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("cuda:N"), std::string::npos) << bad.status().message();
  auto cpu = make_backend("cpu");
  ASSERT_TRUE(cpu.is_ok());
  EXPECT_EQ(cpu.value()->device(), Device::kCPU);
  EXPECT_TRUE(cpu.value()->supports(Op::kAttention));
}

}  // namespace
}  // namespace nibble::backend::testing
